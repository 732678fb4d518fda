"""Starting plans and runs from options: the one place the CLI, the wizard (and next the web app) go through.

``plan_options`` turns the plan options into a ``PlanRequest`` (probing this machine or naming a card) and prints a
plan; ``run.start_run`` checks the dataset, plans or takes a config, and trains under the watchdog.
"""
