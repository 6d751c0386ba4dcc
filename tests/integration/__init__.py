"""The integration with Lightning: the callback in real Trainer fits, and the Lightning features users combine."""
