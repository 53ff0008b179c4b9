"""The autoscaler: pure scaling policies (ours and the baselines it is measured
against), the queue admission rule, and a trace simulator that runs them."""
