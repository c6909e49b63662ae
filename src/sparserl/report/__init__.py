"""The comparison report: tables (`tables`), paired comparisons and verdicts over seeds (`verdicts`, `paired`, on the
statistics of `statistics`), the α section (`alpha`), plots (`plots`)."""
