"""From dataset, family and card to settings with reasons, and the configs written from them."""
