"""Runtime service: plan compiler, durable run store, scheduler and executors."""
