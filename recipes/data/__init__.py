"""DataModules of the recipes.

Every DataModule here keeps a plain ``DataLoader`` whose ``batch_size`` is the per-device
micro-batch (``data.batch_size``): the ``SimiGrad`` callback replaces its batch sampler itself.
Each one also offers ``check_inputs()`` (find user errors before training, raise ``RecipeError``)
and ``model_kwargs()`` (what the model needs to know about the data, e.g. the vocabulary size).
"""
