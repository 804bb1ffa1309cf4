"""`testbed sweep`: one replay per grid point of one or two scenario fields, beside the model."""
