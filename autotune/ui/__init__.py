"""``autotune ui``: the planner, the doctor, runs and reports as a local web app (FastAPI + uvicorn)."""
