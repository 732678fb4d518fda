"""The watchdog that runs the engine as a child process, and the OOM step-down ladder."""
