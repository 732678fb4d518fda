"""The training recipe and its parts: objectives, optimizers, precision, state, validation, sampling."""
