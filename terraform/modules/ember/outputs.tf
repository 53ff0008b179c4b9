output "url" {
  description = "The HTTPS endpoint (point a DNS name matching the certificate at it); EMBER_URL for `ember deploy`"
  value       = "https://${aws_lb.gateway.dns_name}"
}

output "bucket" {
  description = "EMBER_AWS_BUCKET: where `ember deploy --target aws` uploads packages"
  value       = aws_s3_bucket.packages.bucket
}

output "tables" {
  description = "EMBER_AWS_TABLES: the prefix of the nodes and replicas tables"
  value       = "${var.name}-"
}

output "nodes_table" {
  value = aws_dynamodb_table.nodes.name
}

output "replicas_table" {
  value = aws_dynamodb_table.replicas.name
}

output "node_group" {
  description = "EMBER_AWS_ASG: the GPU node Auto Scaling Group whose desired capacity the gateway sets"
  value       = aws_autoscaling_group.nodes.name
}

output "log_groups" {
  value = { gateway = aws_cloudwatch_log_group.gateway.name, nodes = aws_cloudwatch_log_group.nodes.name }
}

output "redis_endpoint" {
  description = "host:port of the shared Redis (null when off); its auth token is in Secrets Manager"
  value       = local.redis ? "${aws_elasticache_replication_group.redis[0].primary_endpoint_address}:6379" : null
}

output "gateway_env" {
  description = "The environment `ember serve --backend aws` reads (EMBER_REDIS_URL is added at boot)"
  value       = local.gateway_env
}
