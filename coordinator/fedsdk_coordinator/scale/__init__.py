"""Past one machine: a fleet's NATS broker cluster (:mod:`.nodes`) and the aggregation workers that sum its
updates (:mod:`.partial`, :mod:`.worker`, :mod:`.combine`)."""
