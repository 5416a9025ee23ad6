"""The node agent (elasticd) and the operator's CLI (elasticctl). Never imports torch."""
