"""The built-in routing policies; each module registers one (``router.routing.base.register_policy``)."""
