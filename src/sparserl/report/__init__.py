"""The comparison report: tables and verdicts (`tables`), the α section (`alpha`), plots (`plots`)."""
