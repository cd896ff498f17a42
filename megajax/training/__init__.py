"""Training: optimizer and schedules, loss scaling, the jitted step, metrics and the loop."""
