"""The capacity planner's measurements: the profile it plans from (`make profile`), the check of its
predictions against the real system (`make plan-check`), and their figures in docs/RESULTS.md."""
