"""One module per command. The library never imports this package."""
