"""Secure aggregation (SecAgg+, Bell et al. CCS 2020; Bonawitz et al. CCS 2017): every value a device sends
carries masks that cancel only in its cluster's sum, so that whoever decrypts one update (any key holder, the
key server) or reads its clear part (the coordinator) reads noise.

``shamir`` (secret sharing), ``ring`` (the mask rings and the generator), ``keys`` (X25519 session keys and
what is derived from them), ``identity`` (signed masking keys, checked against the fleet CA), ``graph``
(neighbours and threshold), ``session`` (a device's side of a session), ``unmask`` (the coordinator's
correction), ``plain`` (masked plaintext updates). The decisions, the collusion and dropout bounds:
docs/threat-model.md.
"""

#: The fewest devices a sum may hold by default: the device refuses to put its update into a smaller one,
#: the key server to decrypt one, the coordinator to form one (docs/threat-model.md).
DEFAULT_MIN_AGGREGATE = 3

__all__ = ["DEFAULT_MIN_AGGREGATE"]
