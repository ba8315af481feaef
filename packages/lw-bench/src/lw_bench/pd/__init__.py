"""``lw-bench pd``: PD TTFT against the prefiller alone (``mode``), the 1P1D stack it starts (``stack``), its table and plot (``report``)."""
