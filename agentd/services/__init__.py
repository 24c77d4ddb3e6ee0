"""Services (issue 14): cluster IPs, node ports and their endpoints in the node's nftables."""
