"""Monarch: the control plane over agent actors (`control.TransferGroup`) and the RDMA
buffers that carry the bytes (`transport`). The only subpackage that imports ``monarch``;
import it where Monarch is installed (``weightbridge.TransferGroup`` does so on first use).
"""
