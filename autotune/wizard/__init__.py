"""``autotune wizard``: interactive setup that ends in config.toml + dataset.toml or a running training.

Modules, one concern each: ``ask`` (questions: questionary, a flag, or ``--yes``'s default), ``steps``
(hardware, base model, dataset, goal and output), ``organise`` (a flat image folder -> ``N_name``),
``overrides`` (a user's value on top of the plan, re-predicted), ``review`` (the plan table and the
override loop) and ``flow`` (the order of the steps and the end: files, commands, training).
"""
