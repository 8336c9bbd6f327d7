"""Checks on the ingress half of a create's `network`: `maskRequestHost` and `httpsPorts`
(the proxy applies them, `proxy.forward`); `allowPublicTraffic` needs none."""

from __future__ import annotations

from agentenv.ports import ENVD_PORT
from agentenv.proxy.upstream import MASK_PORT_PLACEHOLDER, valid_authority


class BadIngress(ValueError):
    """A 400: the message names the field."""


def check_ingress(network: dict[str, object]) -> None:
    mask = network.get("maskRequestHost")
    if mask:
        # E2B takes a host with an optional port, ASCII only (`validateNetworkConfig`:
        # net.SplitHostPort, then IDNA); "${PORT}" may stand anywhere here. As there, an
        # empty value is no mask (its proxy masks only with a non-empty one) and so is an
        # empty port after the colon.
        sample = str(mask).replace(MASK_PORT_PLACEHOLDER, "1").removesuffix(":")
        if not valid_authority(sample):
            raise BadIngress(
                f"network.maskRequestHost {mask!r} is not a valid host[:port] "
                f"(ASCII letters, digits, '.', '-', '_', and {MASK_PORT_PLACEHOLDER})"
            )
    ports = network.get("httpsPorts")
    if isinstance(ports, list):
        for port in ports:
            if not isinstance(port, int) or not 1 <= port <= 65535:
                raise BadIngress(f"network.httpsPorts: {port!r} is not a port number")
            if port == ENVD_PORT:
                raise BadIngress(
                    f"network.httpsPorts: {ENVD_PORT} is envd's port, which speaks plain HTTP"
                )
