"""The pure core: statistics, the controller, window plans; imports nothing of torch or Lightning."""
