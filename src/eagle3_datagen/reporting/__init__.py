"""Plan, status and report: what a run will cost, where it stands, what it produced."""
