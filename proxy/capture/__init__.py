"""Capture: a request kept whole (opt-in, sampled, redacted, bounded, with its own retention),
beside the ledger and never inside its rows. See docs/capture.md."""
