"""Model definitions, layers and weight loading."""
