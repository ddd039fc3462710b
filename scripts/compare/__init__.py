"""The pieces behind the comparison scripts (compare_drafts, compare_evals, compare_first_token,
sweep_decode): which jobs a view runs (runs), how a job is run and logged (jobs), how a budget
becomes steps (plan), and the table and intervals they write (report)."""
