# A worked example: Ember in the default VPC of us-east-1.
#   TF_CLI_CONFIG_FILE=../../cli.tfrc terraform init && terraform apply -var certificate_arn=... -var node_ami_id=... -var gateway_ami_id=...
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
  source             = "../../modules/ember"
  vpc_id             = data.aws_vpc.default.id
  subnet_ids         = data.aws_subnets.default.ids
  certificate_arn    = var.certificate_arn
  node_ami_id        = var.node_ami_id
  gateway_ami_id     = var.gateway_ami_id
  node_instance_type = "g6e.xlarge"
  node_gpus          = 1
  replicas_per_node  = 1
  max_nodes          = 2
}

output "url" {
  value = module.ember.url
}

output "gateway_env" {
  value = module.ember.gateway_env
}
