"""What the tests share and do not collect: small models and data, the gloo process-group harness, the fault worker."""
