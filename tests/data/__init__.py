"""The data: the adaptive batch sampler and its window schedule."""
