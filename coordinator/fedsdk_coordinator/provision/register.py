"""Devices whose certificates were issued outside ``fedsdk provision add-device``: recorded in a fleet.

A load harness's simulated devices get a certificate from the fleet CA each, but no kit
(``fedsdk_bench.swarm``); :func:`register_devices` records them in the ledger and the device list, so that
the broker's rules (the mosquitto ACL, a NATS cluster's users) let them in like provisioned devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from fedsdk.errors import ConfigError
from fedsdk.protocol.topics import validate_config_id
from fedsdk_coordinator.provision.build import open_fleet_dir
from fedsdk_coordinator.provision.fleet import RESERVED_IDS

__all__ = ["register_devices"]


def register_devices(fleet_dir: str | os.PathLike[str], certs: Mapping[str, bytes]) -> int:
    """Record device certificates issued with the fleet's CA outside :func:`add_device` (no kit: a load
    harness's simulated devices) in the ledger and the device list, and rewrite the broker's rules. Each
    certificate must be signed by the fleet CA and name its id as CN. Returns how many were new."""
    with open_fleet_dir(fleet_dir) as fd:
        ca, known, new = (
            x509.load_pem_x509_certificate(fd.ca.cert_pem),
            {c.serial for c in fd.ledger.certs},
            [],
        )
        for cid, pem in certs.items():
            validate_config_id(cid, "device id")
            if cid in RESERVED_IDS:
                raise ConfigError(f"device id {cid!r} is reserved for a service identity")
            cert = x509.load_pem_x509_certificate(pem)
            try:
                cert.verify_directly_issued_by(ca)
            except (ValueError, TypeError, InvalidSignature) as exc:
                raise ConfigError(f"the certificate of {cid!r} is not issued by this fleet's CA") from exc
            cns = [a.value for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
            if cns != [cid]:
                raise ConfigError(f"the certificate given for {cid!r} names {cns}")
            if cert.serial_number not in known:  # each certificate recorded once
                known.add(fd.ledger.record("device", pem).serial)
            if cid not in fd.fleet.devices:
                new.append(cid)
        fd.ledger.save()
        fd.save_fleet(fd.fleet.with_devices((*fd.fleet.devices, *new)))
        return len(new)
