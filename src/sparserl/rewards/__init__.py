"""Scoring completions: TRL's keyword contract, the weighted list of reward functions and the one
process-isolated guard (`runner`), and math grading with math-verify (`grading`)."""
