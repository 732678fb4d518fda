"""Images in: the dataset scan, captions, aspect buckets, the training dataset and its loader."""
