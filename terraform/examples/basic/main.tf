# A worked example: Ember in the default VPC of us-east-1 (the README's "Ember on AWS" walks through it).
#   export TF_CLI_CONFIG_FILE=$PWD/../../cli.tfrc   # only where the provider comes from the offline mirror
#   terraform init && terraform apply -var certificate_arn=... -var node_ami_id=... -var gateway_ami_id=...
terraform {
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

provider "aws" {
  region = "us-east-1"
}

variable "certificate_arn" {
  type = string
}

variable "node_ami_id" {
  type = string
}

variable "gateway_ami_id" {
  type = string
}

variable "gateway_count" {
  type    = number
  default = 1
}

variable "redis" {
  description = "null: on when gateway_count > 1"
  type        = bool
  default     = null
}

variable "waf" {
  type    = bool
  default = true
}

variable "deletion_protection" {
  description = "Set false (and apply) before `terraform destroy`"
  type        = bool
  default     = true
}

variable "force_destroy" {
  description = "Set true (and apply) before `terraform destroy` to delete the buckets with their contents"
  type        = bool
  default     = false
}

data "aws_vpc" "default" {
  default = true
}

data "aws_subnets" "default" {
  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.default.id]
  }
}

module "ember" {
  source              = "../../modules/ember"
  vpc_id              = data.aws_vpc.default.id
  subnet_ids          = data.aws_subnets.default.ids
  certificate_arn     = var.certificate_arn
  node_ami_id         = var.node_ami_id
  gateway_ami_id      = var.gateway_ami_id
  node_instance_type  = "g6e.xlarge"
  node_gpus           = 1
  replicas_per_node   = 1
  max_nodes           = 2
  gateway_count       = var.gateway_count
  redis               = var.redis
  waf                 = var.waf
  deletion_protection = var.deletion_protection
  force_destroy       = var.force_destroy
}

output "url" {
  value = module.ember.url
}

output "bucket" {
  value = module.ember.bucket
}

output "tables" {
  value = module.ember.tables
}

output "node_group" {
  value = module.ember.node_group
}

output "redis_endpoint" {
  value = module.ember.redis_endpoint
}

output "gateway_env" {
  value = module.ember.gateway_env
}
