"""One module per benchmark scenario; bench/run.py runs them side by side."""
