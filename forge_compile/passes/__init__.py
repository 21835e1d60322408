"""Graph rewrites of the post-grad ATen graph, one module per rewrite."""
