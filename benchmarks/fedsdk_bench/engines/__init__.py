"""Broker engines for a 3-node clustered MQTT broker, NATS against RabbitMQ: the code behind
``benchmarks/broker_engines.py`` (its docstring says what is measured; ``docs/results/broker-engines.md``
has the figures).

Modules: ``common`` (ports and sizes, the test fleet, process helpers, the ``Cluster`` base class),
``nats`` and ``rabbitmq`` (each engine's 3-node cluster), ``mqtt`` (fedsdk's transport and raw paho
clients on one asyncio loop), ``checks`` (checks 1-6), ``load`` (the load and throughput figures), ``run``
(one engine's run and the comparison table).
"""
