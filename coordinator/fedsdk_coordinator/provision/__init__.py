"""Fleet provisioning: CA, broker configuration and ACL, HE keys and one kit per identity.

Run on the operator's trusted machine (``fedsdk provision``, DESIGN.md "Keys"). :func:`provision` builds a
fleet directory from a :class:`Fleet` (see :func:`load_fleet` for the file format); :func:`add_device`,
:func:`revoke_device`, :func:`reissue` and :func:`rotate_he` change it. :func:`load_kit` is what a device,
the coordinator or the key server uses to read its own kit. ``certs/README.md`` and
``docs/operations.md`` describe the files and procedures.
"""

from __future__ import annotations

from fedsdk.kit import KIT_FILE, ROLES, HEMaterial, Kit, load_kit, read_he, write_he
from fedsdk_coordinator.provision.build import (
    BundleRequest,
    DeviceReport,
    ProvisionReport,
    RevokeReport,
    add_device,
    provision,
    revoke_device,
)
from fedsdk_coordinator.provision.bundle import PLATFORMS, add_bundle_to_kit, build_bundle
from fedsdk_coordinator.provision.crl import Revocation, build_crl, revoked_serials
from fedsdk_coordinator.provision.fleet import (
    KEY_MODES,
    RESERVED_IDS,
    BrokerSpec,
    Fleet,
    HESpec,
    fleet_from_mapping,
    load_fleet,
)
from fedsdk_coordinator.provision.kit import write_kit
from fedsdk_coordinator.provision.ledger import IssuedCert, Ledger
from fedsdk_coordinator.provision.mosquitto import (
    ACL_TEMPLATE,
    MOSQUITTO_CONF_TEMPLATE,
    render_acl,
    render_in_place_conf,
    render_mosquitto_conf,
)
from fedsdk_coordinator.provision.register import register_devices
from fedsdk_coordinator.provision.rotate import ReissueReport, RotateHEReport, reissue, rotate_he

__all__ = [
    "ACL_TEMPLATE",
    "KEY_MODES",
    "KIT_FILE",
    "MOSQUITTO_CONF_TEMPLATE",
    "PLATFORMS",
    "RESERVED_IDS",
    "ROLES",
    "BrokerSpec",
    "BundleRequest",
    "DeviceReport",
    "Fleet",
    "HEMaterial",
    "HESpec",
    "IssuedCert",
    "Kit",
    "Ledger",
    "ProvisionReport",
    "ReissueReport",
    "Revocation",
    "RevokeReport",
    "RotateHEReport",
    "add_bundle_to_kit",
    "add_device",
    "build_bundle",
    "build_crl",
    "fleet_from_mapping",
    "load_fleet",
    "load_kit",
    "provision",
    "read_he",
    "register_devices",
    "reissue",
    "render_acl",
    "render_in_place_conf",
    "render_mosquitto_conf",
    "revoke_device",
    "revoked_serials",
    "rotate_he",
    "write_he",
    "write_kit",
]
