"""Services: cluster IPs, node ports and their endpoints in the node's nftables."""
