"""The parts of the round engine (:mod:`fedsdk_coordinator.rounds`), each over plain data where it can be:
settings (:mod:`.config`), a cluster's round (:mod:`.state`), measurements of the devices (:mod:`.measure`),
planning (:mod:`.planning`), tasks (:mod:`.tasks`), the inbound handlers (:mod:`.inbound`), one
cluster's round from tasks to record (:mod:`.cluster`) and where its time went (:mod:`.timing`). Resume is
:mod:`fedsdk_coordinator.resume`, the strategies :mod:`fedsdk_coordinator.strategies`."""
