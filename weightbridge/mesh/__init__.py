"""Monarch: the group handle (`group.TransferGroup`), the agent actors serving peer calls
(`agent`), the control plane over them (`control`) and the RDMA buffers that carry the bytes
(`transport`); module map in `control`. The only subpackage that imports ``monarch``;
import it where Monarch is installed (``weightbridge.TransferGroup`` does so on first use).
"""
