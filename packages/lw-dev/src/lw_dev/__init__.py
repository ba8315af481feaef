"""Test support for this workspace (not published, not a dependency of any library package): the
engine runner and harness, the PD oracle and flows, proxy mocks, a faulty pool backend, network-
namespace test hosts, ports. See README.md."""

__version__ = "0.1.0"
