"""One module per compression system: labelling, training data and compression."""
