"""Where a run's time and memory went, and the one thing to change: ``autotune report`` and the end of
``autotune run``.

``load`` reads a run's files (done.json's ``phases``, monitor.jsonl, the plan), ``detector`` finds spills,
swapping and throttling in the monitor trace, ``analysis`` builds the report and names the dominant
bottleneck with its fix, ``render`` prints it (text or JSON) and ``html`` draws it as one self-contained page.
"""
