"""The scaler: a control loop that sizes each tier on its line, and the supervisor
that starts, drains and stops worker replicas (local processes or Docker)."""
