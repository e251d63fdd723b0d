"""Pool rebalancing: the signals a window of requests and polls gives (``signals``), and the
decision made from them (``decide``)."""
