"""The runtime's errors and their help texts, at the bottom of the import graph: the tag check,
the debug fingerprint, the module's order errors and the public API all raise or export them."""

MISMATCH_HELP = (
    "Ranks issued their collectives in different orders. Re-run with MFSDP_CHECK_COLLECTIVES=1 (or "
    "CommunicationPolicy(check_collectives=True)) to stop at the first divergent collective with every "
    "rank's module and call path; torch's flight recorder (TORCH_FR_BUFFER_SIZE=2000) records the "
    "collectives each rank issued."
)

ORDER_HELP = (
    "mfsdp issues collectives in a static order so that ranks running different modules stay in step: "
    "each FSDP module runs forward first in the order its parent registers it (a module called again "
    "later must be called again identically on every rank), and backward once per forward, in reverse. "
    "Register modules in the order they run and call backward once per forward (accumulate with "
    "mfsdp.microbatch)."
)


class CollectiveMismatchError(RuntimeError):
    """Ranks combined different modules' data in one collective (or would have)."""
