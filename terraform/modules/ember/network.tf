# Security groups: clients reach the load balancer on 443; it reaches the gateways on 8443; gateways reach the node
# agents' relays (Linux's ephemeral ports, 32768-60999, where a relay binds port 0) and Redis; gateways and nodes
# reach AWS APIs and PyPI over HTTPS. Nothing else.

resource "aws_security_group" "alb" {
  name_prefix = "${var.name}-alb-"
  description = "${var.name} load balancer: HTTPS from clients, HTTPS to the gateways"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_ingress_rule" "alb_https" {
  for_each          = toset(var.client_cidrs)
  security_group_id = aws_security_group.alb.id
  description       = "HTTPS from clients"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "alb_to_gateway" {
  security_group_id            = aws_security_group.alb.id
  description                  = "HTTPS to the gateways"
  ip_protocol                  = "tcp"
  from_port                    = 8443
  to_port                      = 8443
  referenced_security_group_id = aws_security_group.gateway.id
}

resource "aws_security_group" "gateway" {
  name_prefix = "${var.name}-gateway-"
  description = "${var.name} gateways: HTTPS from the load balancer; out to nodes, Redis and AWS APIs"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_ingress_rule" "gateway_from_alb" {
  security_group_id            = aws_security_group.gateway.id
  description                  = "HTTPS from the load balancer"
  ip_protocol                  = "tcp"
  from_port                    = 8443
  to_port                      = 8443
  referenced_security_group_id = aws_security_group.alb.id
}

resource "aws_vpc_security_group_egress_rule" "gateway_https" {
  security_group_id = aws_security_group.gateway.id
  description       = "HTTPS to AWS APIs (S3, DynamoDB, Auto Scaling, Secrets Manager, CloudWatch) and PyPI"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "gateway_to_nodes" {
  security_group_id            = aws_security_group.gateway.id
  description                  = "Replica relays on the nodes (ephemeral ports the node agents publish)"
  ip_protocol                  = "tcp"
  from_port                    = 32768
  to_port                      = 60999
  referenced_security_group_id = aws_security_group.node.id
}

resource "aws_vpc_security_group_egress_rule" "gateway_to_redis" {
  count                        = local.redis ? 1 : 0
  security_group_id            = aws_security_group.gateway.id
  description                  = "Shared rate-limit state in Redis (TLS)"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = aws_security_group.redis[0].id
}

resource "aws_security_group" "node" {
  name_prefix = "${var.name}-node-"
  description = "${var.name} GPU nodes: replica relays from the gateways; out to AWS APIs and PyPI"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_ingress_rule" "node_from_gateway" {
  security_group_id            = aws_security_group.node.id
  description                  = "Replica relays on ephemeral ports, from the gateways only"
  ip_protocol                  = "tcp"
  from_port                    = 32768
  to_port                      = 60999
  referenced_security_group_id = aws_security_group.gateway.id
}

resource "aws_vpc_security_group_egress_rule" "node_https" {
  security_group_id = aws_security_group.node.id
  description       = "HTTPS to AWS APIs (S3 packages and snapshots, DynamoDB, CloudWatch) and PyPI"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_security_group" "redis" {
  count       = local.redis ? 1 : 0
  name_prefix = "${var.name}-redis-"
  description = "${var.name} Redis: TLS from the gateways only; no egress"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_gateway" {
  count                        = local.redis ? 1 : 0
  security_group_id            = aws_security_group.redis[0].id
  description                  = "Redis (TLS) from the gateways"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = aws_security_group.gateway.id
}
