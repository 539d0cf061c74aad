"""Measuring the step: the bench command and the profiler breakdown (these wait on the
device to time it; the step itself never does)."""
