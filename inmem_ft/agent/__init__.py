"""`inmem-ft run`: torch's elastic agent (torchrun) with the node's SMP, hang detection and the time lost per
failure."""
