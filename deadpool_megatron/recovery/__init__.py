"""Hot-swap recovery: the plan (pure), the agent's coordination of a recovery, each process's
stages (stop, report, await the plan, rebuild, restore, verify, resume), communicator abort."""
