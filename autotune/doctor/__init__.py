"""`autotune doctor`: find what is wrong with a dataset before training does.

Callers (``autotune run``, the wizard) use ``diagnose(folder, family=..., resolution=..., batch=...)`` for a
``DoctorReport``, ``summary_line(report)`` / ``brief(report)`` for one or a few lines, and
``check_before_training(folder, ...)``, which raises a one-line UserError when the report has errors.
Importing this package loads no image or ML library; they load when a dataset is checked.
"""

from autotune.doctor.diagnose import check_before_training, diagnose
from autotune.doctor.report import DoctorReport, Problem, brief, summary_line

__all__ = ["DoctorReport", "Problem", "brief", "check_before_training", "diagnose", "summary_line"]
