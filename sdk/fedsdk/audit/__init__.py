"""The attack a device runs on its own update before sending it (``fedsdk.selfaudit``): the analytic
first-layer recovery (``analytic``) and its image metrics (``metrics``). numpy only.

The operator's attack harness (inverting gradients, label restoration, sweeps, ``fedsdk audit``) is on the
coordinator's side, in ``fedsdk_coordinator.audit``; it uses these two modules too.
"""
