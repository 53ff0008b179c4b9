output "url" {
  description = "The HTTPS endpoint (point a DNS name matching the certificate at it)"
  value       = "https://${aws_lb.gateway.dns_name}"
}

output "bucket" {
  value = aws_s3_bucket.packages.bucket
}

output "node_group" {
  value = aws_autoscaling_group.nodes.name
}

output "gateway_env" {
  description = "The environment `ember serve --backend aws` reads"
  value       = local.gateway_env
}
